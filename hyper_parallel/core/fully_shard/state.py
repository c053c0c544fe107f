"""The hooks of one fully_shard unit, and the root's per-step duties.

Per unit, in forward: gather (waiting for a prefetched all-gather), issue the next unit's
all-gather, compute, free (``reshard_after_forward``), and hook the outputs so that the first
gradient reaching them re-gathers the unit (and issues the next unit's all-gather in backward
order) before its backward computes. Its inputs are hooked too: once backward has passed them the
unit's backward is over, and it launches the unit's reduce-scatter and frees its parameters. That
point is the same on every rank, where "every parameter has its gradient" is not (data decides it:
an MoE expert a rank routed nothing to), and the ranks' reduce-scatters must meet in one order.
A unit whose inputs need no gradient (the root, a first layer) or that ran without them is
reduced at the end of backward. The root (the outermost unit that runs) initialises everything
lazily on its first forward (after ``to_empty``) and, at the end of every backward, launches
what is left, waits for the reductions and hands out the sharded gradients. Its forward first
re-reads what the user may have changed since wrapping (wrap_state.py), and every unit's forward
checks that the ranks run the same unit and call.
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten
from hyper_parallel.core.agreement import check_every
from hyper_parallel.core.fully_shard import wrap_state
from hyper_parallel.core.fully_shard.param_group import UNSHARDED
from hyper_parallel.core.fully_shard.schedule import Schedule
from hyper_parallel.platform import get_platform


class FSDPState:
    def __init__(self, module: Any, group: Any) -> None:
        self.module = module
        self.group = group
        self.schedule = None     # shared with the root once the root initialised
        self.is_root = False
        self._remove_grad_hooks = None
        self._uses = 0           # forward calls whose backward (post-backward hook) is still to come
        self._defer = False      # a call this step had no input to hook: reduce at the end of backward
        platform = get_platform()
        platform.register_forward_pre_hook(module, self._pre_forward, with_kwargs=True)
        platform.register_forward_hook(module, self._post_forward, with_kwargs=True)
        holders = {id(m): m for p in group.params for m, _ in p.locations if m is not module}
        for holder in holders.values():
            platform.register_forward_pre_hook(holder, self._check_gathered)

    # ------------------------------------------------------------------ lazy initialisation
    def _lazy_init(self):
        """This unit is the first to run: it becomes the root of every unit below it."""
        platform = get_platform()
        states = [s for _, m in platform.named_modules(self.module)
                  if (s := getattr(m, "_hp_fsdp_state", None)) is not None]
        schedule = Schedule(states)
        for state in states:
            state.schedule = schedule
            state.is_root = state is self
            state.group.lazy_init()
            if state is not self and state._remove_grad_hooks is not None:
                # it ran alone before and was its own root; this root's hooks cover it now
                state._remove_grad_hooks()
                state._remove_grad_hooks = None
        paths = wrap_state.module_paths(self.module)
        for state in states:
            state.path = paths[id(state.module)] or f"the root {type(self.module).__name__}"
            for p in state.group.params:
                module, attr = p.locations[0]
                p.text = f"'{'.'.join(filter(None, (paths.get(id(module)), attr)))}'"
        self._register_grad_hooks()
        self._synced = False     # the wrap state is checked across ranks at the first forward

    def _register_grad_hooks(self):
        if self._remove_grad_hooks is not None:
            self._remove_grad_hooks()
        trainable = [p.unsharded for s in self.schedule.states for p in s.group.trainable]
        # the hooks only queue the end-of-backward callback (a backward that skipped the root's output)
        self._remove_grad_hooks = get_platform().register_grad_ready_hooks(trainable, lambda param: None,
                                                                           self._finish_unless_queued)

    def _sync_wrap_state(self):
        """Root, each forward: what the user changed since wrapping (wrap_state.py); a change, the
        first forward and every forward under HP_CHECK_RANKS=every are checked across the ranks."""
        changed = [s.group.sync_with_module() for s in self.schedule.states]
        wrap_state.check_no_new_parameters(self.module, self.schedule.states)
        if any(changed):
            self._register_grad_hooks()
        if any(changed) or not self._synced or check_every():
            wrap_state.agree(self.group.mesh_info.mesh, self.schedule.states, self.schedule)
            self._synced = True

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module, args, kwargs):
        if self.schedule is None:
            self._lazy_init()
        if self.is_root:
            self._sync_wrap_state()
            self.schedule.begin_forward()
        self.schedule.record_pre_forward(self)
        wrap_state.agree_call(self.group.mesh_info.mesh, self, self.schedule.calls_of(self))
        with get_platform().profile_range("hyper_parallel::fully_shard::all_gather"):
            self.group.wait_for_unshard()
            following = self.schedule.next_forward(self)
            if following is not None:
                following.group.unshard()    # overlaps this unit's compute
        if get_platform().is_grad_enabled() and self.group.trainable:
            args, kwargs = self._hook_post_backward(args, kwargs)
        policy = self.group.policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _check_gathered(self, holder, args):
        """A sub-module holding this unit's parameters runs: they must be gathered, which they are
        inside the unit's forward (or after ``unshard()``). Called on its own (``model.inp(x)``
        instead of ``model(x)``) it would compute with this rank's shards."""
        if self.group.state != UNSHARDED:
            raise ValueError(
                f"fully_shard: {type(holder).__name__} computes with parameters of the "
                f"{type(self.module).__name__} unit, which "
                f"are not gathered: it was called outside that unit's forward (e.g. model.inp(x) instead "
                f"of model(x)). Call the module fully_shard was applied to, or gather its parameters "
                f"around the call: unit.unshard() before, unit.reshard() after")

    def _post_forward(self, module, args, kwargs, output):
        self.schedule.record_post_forward(self)
        platform = get_platform()
        training = platform.is_grad_enabled()
        # the root keeps its parameters for the backward that starts with them (as PyTorch's FSDP2)
        if self.group.reshard_after_forward and not (self.is_root and training):
            self.group.reshard()
        if self.is_root:
            self.schedule.end_forward()
        tensors = [t for t in tree_flatten(output)[0] if platform.is_tensor(t) and platform.requires_grad(t)]
        if tensors and training:
            platform.register_multi_grad_hook(tensors, self._pre_backward)
        if self.group.policy.output_dtype is not None:
            output = _cast_floating(output, self.group.policy.output_dtype)
        return output

    # ------------------------------------------------------------------ backward
    def _pre_backward(self):
        if self.is_root and not self.schedule.pending_final:
            self.schedule.pending_final = True
            get_platform().queue_backward_callback(self._finish_backward)
        with get_platform().profile_range("hyper_parallel::fully_shard::all_gather"):
            self.group.wait_for_unshard()
            following = self.schedule.next_backward(self)
            if following is not None:
                following.group.unshard()

    def _hook_post_backward(self, args, kwargs):
        """Run ``_post_backward`` once backward has passed every input of this call that needs a
        gradient. An input made by an op gets a hook that runs before that op's backward node,
        which autograd runs after every node of this unit's backward, the accumulation of the
        parameters' gradients included. A leaf input has no such node (a hook on it could run
        before the parameters' accumulation), so leaves pass one identity autograd node instead (a
        leaf that needs a gradient cannot be modified in place anyway: the identity's view may not)."""
        platform = get_platform()
        self.group.backward_pending = True
        found = []
        _map_grad_tensors((args, kwargs), found.append)
        if not found:
            self._defer = True
            return args, kwargs
        leaves = [t for t in found if platform.is_autograd_leaf(t)]
        made = [t for t in found if not platform.is_autograd_leaf(t)]
        self._uses += bool(leaves) + bool(made)
        if made:
            platform.register_multi_grad_hook(made, self._post_backward, mode="all")
        if not leaves:
            return args, kwargs
        routed = _POST_BACKWARD(self, *leaves)
        routed = dict(zip(map(id, leaves), routed if isinstance(routed, tuple) else (routed,)))
        return _map_grad_tensors((args, kwargs), lambda t: routed.get(id(t), t))

    def _post_backward(self):
        """Backward has passed one call's inputs (or its leaf inputs, or the others: each counts
        once in ``_uses``): once every call's have, the unit's backward is over."""
        self._uses -= 1
        if self._uses > 0 or self._defer:   # another call's backward is still to come
            return
        with get_platform().profile_range("hyper_parallel::fully_shard::reduce_scatter"):
            self.group.reduce_grads()
        if self.group.reshard_after_backward:
            self.group.reshard()

    def _finish_unless_queued(self):
        """The hooks' end-of-backward callback, queued for every backward pass that produces a
        gradient: a reentrant activation checkpoint's recomputation runs a backward of its own
        inside the outer one, and its end is not the step's. Where the root's output queued the
        callback on the outer backward, that one finishes."""
        if self.schedule is not None and not self.schedule.pending_final:
            self._finish_backward()

    def _finish_backward(self):
        """End of backward: launch the reductions of the units that ran forward but were not reduced
        yet (in the same unit order on every rank), wait for every reduction in launch order, hand
        out the sharded gradients, free what is still gathered."""
        schedule = self.schedule
        if schedule is None:
            return
        schedule.pending_final = False
        groups = [s.group for s in schedule.states]
        with get_platform().profile_range("hyper_parallel::fully_shard::reduce_scatter"):
            for state in schedule.states:
                if state.group.backward_pending:
                    state.group.reduce_grads()
                state.group.backward_pending = False
                state._uses, state._defer = 0, False
            for group in groups:
                group.start_replicate_reduce()
            for group in groups:
                group.finish_reduce()
        for group in groups:
            if group.reshard_after_backward:
                group.reshard()


def _map_grad_tensors(tree, fn):
    """``tree`` with each tensor that needs a gradient replaced by ``fn(tensor)``, inside plain
    tuples, lists and dicts only (their subclasses, a model's output classes, stay as they are)."""
    platform = get_platform()
    if type(tree) in (tuple, list):
        return type(tree)(_map_grad_tensors(x, fn) for x in tree)
    if type(tree) is dict:
        return {k: _map_grad_tensors(v, fn) for k, v in tree.items()}
    if platform.is_tensor(tree) and platform.requires_grad(tree):
        return fn(tree)
    return tree


def _identity_forward(ctx, state, *tensors):
    ctx.state = state
    out = tuple(t.view_as(t) for t in tensors)
    return out if len(out) > 1 else out[0]


def _identity_backward(ctx, *grads):
    ctx.state._post_backward()
    return (None,) + grads


_POST_BACKWARD = lazy_autograd_function("FullyShardPostBackward", _identity_forward, _identity_backward)


def _cast_floating(tree, dtype):
    """Floating tensors of a nested (tuple / list / dict) structure cast to ``dtype``."""
    platform = get_platform()
    if platform.is_tensor(tree):
        return tree.to(dtype) if platform.is_floating_point(tree) and tree.dtype != dtype else tree
    if isinstance(tree, (tuple, list)):
        items = [_cast_floating(x, dtype) for x in tree]
        return type(tree)(items) if type(tree) in (tuple, list) else type(tree)(*items)
    if isinstance(tree, dict):
        out = dict(tree) if type(tree) is dict else tree   # a model's output class is filled in place
        for key in list(out):
            out[key] = _cast_floating(out[key], dtype)
        return out
    return tree
