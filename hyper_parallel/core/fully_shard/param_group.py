"""The parameters of one fully_shard unit and their two collectives: one flat all-gather of every
rank's padded shards (``unshard``) and one flat reduce-scatter of the gradients (``reduce_grads``).

Layout of a rank's flat buffer: each parameter's padded piece at its ``offset``. The all-gather
output is [ranks, flat size]; parameter p's full tensor is column block p, rows in rank order.
The reduce-scatter input has that same layout, so each rank receives exactly its flat buffer.
"""
from hyper_parallel.core.data_parallel.reducer import Collective, FlatReduction
from hyper_parallel.core.fully_shard import wrap_state
from hyper_parallel.core.fully_shard.mixed_precision import compute_dtypes
from hyper_parallel.platform import get_platform

SHARDED, UNSHARDING, UNSHARDED = "sharded", "unsharding", "unsharded"


class FSDPParamGroup:
    def __init__(self, params, mesh_info, policy, average):
        self.params = params
        self.mesh_info = mesh_info
        self.policy = policy
        self.op = "avg" if average else "sum"
        self.flat_numel = 0
        for p in params:
            p.offset = self.flat_numel
            self.flat_numel += p.padded_numel
        self.state = SHARDED
        self._gather = None          # the async all-gather while UNSHARDING
        self._reduce = None          # the PendingReduction of this backward's gradients until it ends
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.backward_pending = False   # ran forward with gradients since its last reduction
        self.trainable = [p for p in params if p.requires_grad]

    def sync_with_module(self):
        """The root's check at each forward (wrap_state.py): adopt a ``requires_grad`` or dtype the
        user changed since wrapping; True if anything changed."""
        if not self.params:
            return False
        held_sharded = self.state != UNSHARDED
        may_retype = self.state == SHARDED
        changed = [wrap_state.sync_param(p, held_sharded, may_retype) for p in self.params]
        if not any(changed):
            return False
        self.trainable = [p for p in self.params if p.requires_grad]
        if may_retype:
            self.lazy_init()   # one dtype per unit, and the gathered tensors in the new one
        return True

    def dtypes(self):
        orig = self.params[0].orig_dtype if self.params else None
        return compute_dtypes(self.policy, orig)

    def lazy_init(self):
        for p in self.params:
            p.refresh()
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) > 1 and self.policy.param_dtype is None:
            raise ValueError(f"fully_shard: one unit holds parameters of dtypes {sorted(map(str, dtypes))}; "
                             f"its flat all-gather needs one: give them one dtype, or set "
                             f"MixedPrecisionPolicy(param_dtype=...)")
        for p in self.params:
            p.init_unsharded(self.dtypes()[0])

    # ------------------------------------------------------------------ parameters
    def unshard(self):
        """Launch the all-gather (asynchronous; ``wait_for_unshard`` completes it)."""
        if self.state != SHARDED or not self.params:
            self.state = UNSHARDED if not self.params else self.state
            return
        platform = get_platform()
        local = self.params[0].sharded._local_tensor
        # not zero-filled: a slot's padding is gathered and dropped (copy_gathered_out reads real rows)
        flat = platform.empty((self.flat_numel,), dtype=self.dtypes()[0], device=local.device)
        with platform.no_grad():
            for p in self.params:
                p.copy_shard_into(flat)
            self._gather = platform.all_gather(flat, self.mesh_info.shard_group, 0, async_op=True)
        self.state = UNSHARDING

    def wait_for_unshard(self):
        if self.state == SHARDED:
            self.unshard()
        if self.state != UNSHARDING:
            return
        platform = get_platform()
        gathered = self._gather.wait().view(self.mesh_info.shard_size, self.flat_numel)
        self._gather = None
        with platform.no_grad():
            for p in self.params:
                p.copy_gathered_out(gathered)
                p.swap(p.unsharded)
        self.state = UNSHARDED

    def reshard(self):
        if self.state == UNSHARDING:
            self.wait_for_unshard()
        if self.state != UNSHARDED:
            return
        for p in self.params:
            p.free()
            p.swap(p.sharded)
        self.state = SHARDED

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self):
        """Launch the reduce-scatter of this backward's gradients (or keep them unreduced under
        set_requires_gradient_sync(False)); once per backward. Every rank calls it for every unit
        at the same point of backward (state.py), whatever gradients it holds, so the collectives
        stay matched: the one gradient reducer (core/data_parallel/reducer.py) sends zeros for a
        parameter without a gradient here and one presence flag per parameter in each row, so that
        a gradient some rank has reaches every rank's shard (MoE experts a rank routed nothing to)
        while one no rank has stays None."""
        if self._reduce is not None or not self.trainable:
            return
        reduce_dtype = self.dtypes()[1]
        platform = get_platform()
        with platform.no_grad():
            if not self.requires_gradient_sync:
                for p in self.trainable:
                    p.accumulate(reduce_dtype)
                return
            grads = [p.take_grad() if p.requires_grad else None for p in self.params]

            def fill(flat2d):
                # padding columns are left as they are: their sums land where set_sharded_grad never reads
                for p, grad in zip(self.params, grads):
                    if grad is None:
                        p.zero_grad_slot(flat2d)
                    else:
                        p.copy_grad_into(flat2d, grad)
            reduction = FlatReduction(Collective.REDUCE_SCATTER, self.mesh_info.shard_group, self.op)
            self._reduce = reduction.launch_rows(
                self.mesh_info.shard_size, self.flat_numel, [g is not None for g in grads], reduce_dtype,
                self.params[0].sharded._local_tensor.device, fill)

    def start_replicate_reduce(self):
        """HSDP: once the reduce-scatter is done, all-reduce the shard over dp_replicate (async)."""
        if self._reduce is None or self.mesh_info.replicate_group is None:
            return
        self._reduce.then_all_reduce(self.mesh_info.replicate_group)

    def finish_reduce(self):
        """Wait for this unit's reduction and hand each parameter its sharded gradient: those a rank
        had (one no rank reached keeps None, as in one process)."""
        if self._reduce is None:
            return
        pending, self._reduce = self._reduce, None
        shard = pending.wait()
        with get_platform().no_grad():
            wanted = [p.requires_grad for p in self.params]
            for p, anywhere in zip(self.params, pending.present_anywhere(shard, wanted)):
                if anywhere:
                    p.set_sharded_grad(shard)
