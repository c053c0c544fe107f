"""Rank-side machinery for the DTensor op tests (see test_dtensor_ops.py): build inputs in given
placements, run an op on DTensors and on plain tensors, compare values, layouts and gradients."""
import traceback
import zlib

TOL = {"atol": 1e-5, "rtol": 1e-5}


# ================================================================================ rank-side helpers
class D:
    """Marks a check input that becomes a DTensor with ``placements``."""

    def __init__(self, tensor, *placements):
        self.tensor, self.placements = tensor, placements


class Checks:
    def __init__(self, mesh):
        self.mesh = mesh
        self.failures = []
        self.count = 0

    # ------------------------------------------------------------------------ data
    @staticmethod
    def gen(name, salt=""):
        import torch
        return torch.Generator().manual_seed(zlib.crc32(f"{name}/{salt}".encode()))

    def randn(self, name, *shape):
        import torch
        return torch.randn(shape, generator=self.gen(name, str(shape)))

    def make(self, x, placements, name):
        """A DTensor leaf with ``placements`` whose global value is ``x``."""
        import torch
        from hyper_parallel import DTensor, Replicate, distribute_tensor
        base = [Replicate() if p.is_partial() else p for p in placements]
        local = distribute_tensor(x, self.mesh, base, src_data_rank=None).to_local().clone()
        coord = self.mesh.get_coordinate()
        for m, p in enumerate(placements):
            if not p.is_partial():
                continue
            n = self.mesh.size(m)
            noise = [torch.randn(local.shape, generator=self.gen(name, f"partial{m}/{i}")).to(local.dtype)
                     for i in range(n)]
            mean = sum(noise) / n
            c = coord[m]
            if p.reduce_op == "sum":
                local = local / n + noise[c] - mean
            elif p.reduce_op == "avg":
                local = local + noise[c] - mean
            elif p.reduce_op == "max":
                local = local if c == 0 else local - noise[c].abs() - 0.1
            else:
                local = local if c == 0 else local + noise[c].abs() + 0.1
        dt = DTensor.from_local(local, self.mesh, placements, shape=tuple(x.shape))
        if x.is_floating_point():
            dt.requires_grad_()
        return dt

    # ------------------------------------------------------------------------ the check
    def check(self, name, fn, *inputs, out=None, backward=True, tol=None):
        """``out``: expected placements of every output (a tuple), or a list with one per output."""
        self.count += 1
        try:
            self._check(name, fn, inputs, out, backward, tol or TOL)
        except Exception as exc:  # noqa: BLE001  (reported to the test with the check's name)
            self.failures.append(f"[{name}] {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")

    def _check(self, name, fn, inputs, out, backward, tol):
        import torch
        from hyper_parallel import DTensor
        from hyper_parallel.core.dtensor.layout import grad_placements

        refs, dts = [], []
        for k, item in enumerate(inputs):
            if isinstance(item, D):
                ref = item.tensor.clone()
                if ref.is_floating_point():
                    ref.requires_grad_()
                refs.append(ref)
                dts.append(self.make(item.tensor, item.placements, f"{name}/{k}"))
            else:
                refs.append(item)
                dts.append(item)
        ref_out = _as_list(fn(*refs))
        dt_out = _as_list(fn(*dts))
        assert len(ref_out) == len(dt_out), f"{len(dt_out)} outputs, expected {len(ref_out)}"
        expected = out if isinstance(out, list) else [out] * len(dt_out)
        loss_ref, loss_dt = 0, 0
        for i, (r, d) in enumerate(zip(ref_out, dt_out)):
            assert isinstance(d, DTensor), f"output {i} is a {type(d).__name__}, not a DTensor"
            assert tuple(d.shape) == tuple(r.shape), \
                f"output {i}: global shape {tuple(d.shape)} != {tuple(r.shape)}"
            assert tuple(d.to_local().shape) == d._spec.local_shape, \
                f"output {i}: local shape {tuple(d.to_local().shape)} does not match its layout " \
                f"{d.placements} (expected {d._spec.local_shape})"
            if expected[i] is not None:
                assert tuple(d.placements) == tuple(expected[i]), \
                    f"output {i}: placements {d.placements}, expected {tuple(expected[i])}"
            full = d.full_tensor()
            torch.testing.assert_close(full.detach(), r.detach(), **tol,
                                       msg=lambda m, i=i: f"forward output {i}: {m}")
            if r.is_floating_point() and r.requires_grad:
                w = torch.randn(tuple(r.shape), generator=self.gen(name, f"w{i}")).to(r.dtype)
                loss_ref = loss_ref + (r * w).sum()
                loss_dt = loss_dt + (full * w).sum()
        if not backward or not torch.is_tensor(loss_ref):
            return
        loss_ref.backward()
        loss_dt.backward()
        for k, (ref, dt) in enumerate(zip(refs, dts)):
            if not isinstance(dt, DTensor) or not dt.requires_grad:
                continue
            if ref.grad is None:  # the output does not depend on this input
                assert dt.grad is None or not dt.grad.full_tensor().any(), f"input {k}: unexpected gradient"
                continue
            want = ref.grad
            assert dt.grad is not None, f"input {k} got no gradient"
            assert isinstance(dt.grad, DTensor), f"input {k}: gradient is a {type(dt.grad).__name__}"
            assert tuple(dt.grad.placements) == grad_placements(dt.placements), \
                f"input {k}: gradient placements {dt.grad.placements}, " \
                f"expected {grad_placements(dt.placements)}"
            torch.testing.assert_close(dt.grad.full_tensor(), want, **tol,
                                       msg=lambda m, k=k: f"gradient of input {k}: {m}")


def _as_list(result):
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def _mesh(shape):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", shape)


# ================================================================================ op families
