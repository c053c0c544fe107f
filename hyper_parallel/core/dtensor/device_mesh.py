"""DeviceMesh: an n-D grid of global ranks with one process group per mesh dim.

Every mesh keeps ``_full``: the rank grid of all its "sibling" meshes (the same slice taken at every
other coordinate of the root) with the mesh's own dims last. Group creation walks every line of
``_full`` in a fixed order, so all ranks create the same groups in the same order and group
creation can never deadlock.
"""
from typing import Any, Optional
import math
import numbers
import threading

import numpy as np

from hyper_parallel.core.arguments import check_optional_float
from hyper_parallel.platform import get_platform

_state = threading.local()


def _mesh_stack():
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def current_mesh() -> Any:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _mesh_stack()
    return stack[-1] if stack else None


class DeviceMesh:
    def __init__(self, device_type: Any, mesh: Any, *, mesh_dim_names: Any = None, _full: Any = None,
                 _root: Any = None, _root_dims: Any = None, _timeout: Any = None,
                 _groups: Any = None) -> None:
        platform = get_platform()
        array = np.asarray(mesh.tolist() if hasattr(mesh, "tolist") else mesh, dtype=np.int64)
        if array.ndim == 0:
            array = array.reshape(1)
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != array.ndim:
                raise ValueError(f"mesh_dim_names {mesh_dim_names} has {len(mesh_dim_names)} names for a "
                                 f"{array.ndim}-D mesh of shape {array.shape}")
            if len(set(mesh_dim_names)) != len(mesh_dim_names):
                raise ValueError(f"mesh_dim_names {mesh_dim_names} repeats a name")
        if len(np.unique(array)) != array.size:
            raise ValueError(f"mesh {array.tolist()} lists a rank twice")
        self.device_type = device_type
        self._mesh = array
        self._dim_names = mesh_dim_names
        self._root = _root
        self._full = array.reshape((1,) + array.shape) if _full is None else _full
        self._root_dims = _root_dims if _root_dims is not None else tuple((d,) for d in range(array.ndim))
        self._flattened: dict[Any, Any] = {}
        self._timeout = _timeout
        if not platform.is_initialized():
            platform.init_process_group()
        world = platform.get_world_size()
        outside = sorted({int(r) for r in array.reshape(-1) if not 0 <= r < world})
        if outside:  # the framework would fail later, inside group creation, with its own message
            raise ValueError(f"mesh {array.tolist()} names rank(s) {outside} outside the world of {world} "
                             f"ranks (0..{world - 1}); build the mesh from ranks that exist")
        self._rank = platform.get_rank()
        where = np.argwhere(array == self._rank)
        self._coordinate = tuple(int(c) for c in where[0]) if len(where) else None
        # from_group meshes keep the user's groups: creating others would need every world rank
        self._given_groups = _groups is not None
        self._groups = list(_groups) if _groups is not None else self._create_groups(platform)

    # ------------------------------------------------------------------ groups
    def _create_groups(self, platform):
        groups = []
        copies = self._full.ndim - self._mesh.ndim
        for dim in range(self._mesh.ndim):
            lines = np.moveaxis(self._full, copies + dim, -1).reshape(-1, self._mesh.shape[dim])
            mine = None
            for line in lines:  # every rank walks every line in the same order
                ranks = tuple(int(r) for r in line)
                group = platform.new_group(ranks) if self._timeout is None else \
                    platform.new_group(ranks, timeout_s=self._timeout)
                if self._rank in line:
                    mine = group
            groups.append(mine)
        return groups

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self) -> Any:
        return self._mesh.ndim

    @property
    def mesh_shape(self) -> Any:
        return tuple(self._mesh.shape)

    shape = mesh_shape

    @property
    def mesh(self) -> Any:
        return get_platform().tensor(self._mesh.tolist())

    @property
    def mesh_dim_names(self) -> Any:
        return self._dim_names

    @property
    def rank_list(self) -> Any:
        return tuple(int(r) for r in self._mesh.reshape(-1))

    @property
    def root_mesh(self) -> Any:
        return self._root

    def size(self, dim: Any = None) -> Any:
        return int(self._mesh.size) if dim is None else int(self._mesh.shape[self._dim_index(dim)])

    def get_rank(self) -> Any:
        return self._rank

    def get_coordinate(self) -> Any:
        return self._coordinate

    def get_group(self, dim: Any = None) -> Any:
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() of a {self.ndim}-D mesh needs a dim (index or name in "
                                 f"{self._dim_names})")
            dim = 0
        dim = self._dim_index(dim)
        self._check_alive()
        if self._coordinate is None:
            # a None group would mean the whole world to the framework: a collective on it hangs
            raise ValueError(f"rank {self._rank} is not part of mesh {self.rank_list}, so it has no group on "
                             f"mesh dim {dim}; run collectives of this mesh only on its ranks (check "
                             f"mesh.get_coordinate() is not None)")
        return self._groups[dim]

    def _check_alive(self):
        """A mesh's groups die with ``destroy_process_group``; the framework would then fail on a
        stale group with a bare KeyError, so name what happened and what to do instead."""
        if not get_platform().is_initialized():
            raise RuntimeError(f"the process group of {self!r} is gone: destroy_process_group() was called "
                               f"after this mesh (and the DTensors on it) were created. Use DTensors only "
                               f"before destroy_process_group(), or initialise again and build a new mesh "
                               f"(init_device_mesh) and new DTensors on it")

    def get_local_rank(self, dim: Any = None) -> Any:
        if self._coordinate is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {self.rank_list}")
        return self._coordinate[self._dim_index(0 if dim is None else dim)]

    def group_ranks(self, dim: Any) -> Any:
        """The global ranks of this rank's group along ``dim``, in mesh order."""
        dim = self._dim_index(dim)
        index = list(self._anchor(f"group on mesh dim {dim}"))
        index[dim] = slice(None)
        return tuple(int(r) for r in self._mesh[tuple(index)])

    def _dim_index(self, dim):
        if isinstance(dim, str):
            if not self._dim_names or dim not in self._dim_names:
                raise KeyError(f"mesh has no dim named {dim!r}; its dims are {self._dim_names}")
            return self._dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    # ------------------------------------------------------------------ slicing
    def _root_or_self(self):
        return self._root or self

    def _anchor(self, what="a sub-mesh"):
        """This rank's coordinate. A rank outside the mesh has no sub-mesh of its own (PyTorch gives
        each rank the one containing it): any choice would be a mesh it is not part of, on which
        its collectives would hang or join foreign groups, so it is an error."""
        if self._coordinate is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {self.rank_list}, so it has no {what} "
                             f"of it (each rank gets the sub-mesh that contains it); slice the mesh only on "
                             f"its ranks (check mesh.get_coordinate() is not None first)")
        return self._coordinate

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        root = self._root_or_self()
        if len(names) == 1 and names[0] in root._flattened:
            self._anchor(f"sub-mesh {names[0]!r}")
            return root._flattened[names[0]]
        if not self._dim_names:
            raise KeyError("this mesh has no dim names; create it with mesh_dim_names=... to slice it")
        missing = [n for n in names if n not in self._dim_names]
        if missing:
            raise KeyError(f"mesh dims {missing} not found; available: {self._dim_names} and flattened "
                           f"{tuple(root._flattened)}")
        self._anchor(f"sub-mesh {names}")
        if names == self._dim_names:
            return self
        return self._select([self._dim_names.index(n) for n in names])

    def _select(self, dims):
        """The sub-mesh over ``dims`` (in that order) that contains this rank."""
        others = [d for d in range(self.ndim) if d not in dims]
        index = tuple(self._anchor()[d] if d in others else slice(None) for d in range(self.ndim))
        sub = np.transpose(self._mesh[index], np.argsort(np.argsort(dims)))
        copies = self._full.ndim - self.ndim
        full = np.transpose(self._full, list(range(copies)) + [copies + d for d in others] +
                            [copies + d for d in dims])
        groups = [self._groups[d] for d in dims] if self._given_groups else None
        return DeviceMesh(self.device_type, sub, mesh_dim_names=tuple(self._dim_names[d] for d in dims),
                          _full=full, _root=self._root_or_self(), _groups=groups,
                          _root_dims=tuple(self._root_dims[d] for d in dims), _timeout=self._timeout)

    def flatten(self, name: Optional[str] = None) -> Any:
        """This mesh as one dim (row-major); registered on the root under ``name``."""
        name = name or "_".join(self._dim_names or (f"dim{d}" for d in range(self.ndim)))
        root = self._root_or_self()
        if name in root._flattened:
            return root._flattened[name]
        copies = self._full.ndim - self.ndim
        full = self._full.reshape(self._full.shape[:copies] + (self._mesh.size,))
        flat = DeviceMesh(self.device_type, self._mesh.reshape(-1), mesh_dim_names=(name,), _full=full,
                          _root=root, _root_dims=(sum(self._root_dims, ()),), _timeout=self._timeout)
        root._flattened[name] = flat
        return flat

    _flatten = flatten

    def _unflatten(self, dim_name, sizes, names):
        """Split mesh dim ``dim_name`` into dims of ``sizes`` called ``names`` (a new mesh)."""
        dim = self._dim_index(dim_name)
        sizes, names = tuple(sizes), tuple(names)
        if math.prod(sizes) != self._mesh.shape[dim] or len(sizes) != len(names):
            raise ValueError(f"cannot unflatten mesh dim {dim_name!r} of size {self._mesh.shape[dim]} "
                             f"into sizes {sizes} named {names}")
        shape = self._mesh.shape[:dim] + sizes + self._mesh.shape[dim + 1:]
        copies = self._full.ndim - self.ndim
        full = self._full.reshape(self._full.shape[:copies] + shape)
        dim_names = list(self._dim_names or (f"dim{d}" for d in range(self.ndim)))
        dim_names[dim:dim + 1] = names
        return DeviceMesh(self.device_type, self._mesh.reshape(shape), mesh_dim_names=tuple(dim_names),
                          _full=full, _timeout=self._timeout)

    @staticmethod
    def concatenate(meshes: Any) -> Any:
        """One mesh of the dims of ``meshes`` (disjoint names, same root), in the root's dim order."""
        meshes = list(meshes)
        roots = {id(m._root_or_self()) for m in meshes}
        if len(roots) != 1:
            raise ValueError("DeviceMesh.concatenate needs meshes sliced from the same root mesh")
        root = meshes[0]._root_or_self()
        entries = []
        for mesh in meshes:
            for d in range(mesh.ndim):
                entries.append((mesh._root_dims[d], mesh._dim_names[d] if mesh._dim_names else None))
        names = [n for _, n in entries]
        if None in names or len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh.concatenate needs distinct dim names, got {names}")
        used = sorted(sum((dims for dims, _ in entries), ()))
        if len(set(used)) != len(used):
            raise ValueError(f"meshes {names} overlap in the root's dims")
        entries.sort(key=lambda e: e[0][0])
        order = sum((dims for dims, _ in entries), ())
        others = [d for d in range(root.ndim) if d not in order]
        anchor = root._anchor("concatenated sub-mesh")
        index = tuple(anchor[d] if d in others else slice(None) for d in range(root.ndim))
        kept = [d for d in range(root.ndim) if d in order]
        sub = np.transpose(root._mesh[index], [kept.index(d) for d in order])
        sizes = [math.prod(root._mesh.shape[d] for d in dims) for dims, _ in entries]
        copies = root._full.ndim - root.ndim
        full = np.transpose(root._full, list(range(copies)) + [copies + d for d in others] +
                            [copies + d for d in order])
        lead = full.shape[:copies + len(others)]
        return DeviceMesh(root.device_type, sub.reshape(sizes), mesh_dim_names=tuple(n for _, n in entries),
                          _full=full.reshape(lead + tuple(sizes)), _root=root,
                          _root_dims=tuple(dims for dims, _ in entries), _timeout=root._timeout)

    @staticmethod
    def from_group(group: Any, device_type: Any, mesh: Any = None, *, mesh_dim_names: Any = None) -> Any:
        """A mesh over existing process group(s), as PyTorch's ``DeviceMesh.from_group``: one group
        gives a 1-D mesh of its ranks (``mesh`` optional); a list of groups, one per mesh dim, needs
        ``mesh`` (the global rank grid), and each group must be this rank's line of it on its dim.
        The groups are used as they are (no new group is created, so only their members need call
        this)."""
        groups = list(group) if isinstance(group, (list, tuple)) else [group]
        platform = get_platform()
        if mesh is None:
            if len(groups) != 1:
                raise ValueError(f"DeviceMesh.from_group with {len(groups)} groups needs mesh= (the rank "
                                 f"grid, one dim per group)")
            mesh = list(platform.group_ranks(groups[0]))
        array = np.asarray(mesh.tolist() if hasattr(mesh, "tolist") else mesh, dtype=np.int64)
        if array.ndim != len(groups):
            raise ValueError(f"DeviceMesh.from_group: mesh of shape {array.shape} has {array.ndim} dims but "
                             f"{len(groups)} group(s) were given; pass one group per mesh dim")
        out = DeviceMesh(device_type, array, mesh_dim_names=mesh_dim_names, _groups=groups)
        if out.get_coordinate() is not None:
            for dim, g in enumerate(groups):
                line, have = out.group_ranks(dim), tuple(platform.group_ranks(g))
                if line != have:
                    raise ValueError(f"DeviceMesh.from_group: group {dim} has ranks {have}, but this rank's "
                                     f"line of mesh {array.tolist()} on dim {dim} is {line}; pass the groups "
                                     f"in mesh-dim order, each the one containing this rank")
        return out

    # ------------------------------------------------------------------ identity
    def to_hash(self) -> Any:
        key = self.__dict__.get("_identity")
        if key is None:  # a mesh never changes: computed once (dispatch compares meshes per op)
            key = self.__dict__["_identity"] = (self.mesh_shape, self._dim_names, self.rank_list)
        return key

    def __eq__(self, other):
        return self is other or (isinstance(other, DeviceMesh) and self.to_hash() == other.to_hash())

    def __hash__(self):
        return hash(self.to_hash())

    def __repr__(self):
        names = f", mesh_dim_names={self._dim_names}" if self._dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self._mesh.tolist()}{names})"

    def __enter__(self):
        _mesh_stack().append(self)
        return self

    def __exit__(self, *exc):
        _mesh_stack().pop()
        return False


def init_device_mesh(device_type: Any, mesh_shape: Any, *, mesh_dim_names: Any = None,
                     timeout: Any = None) -> Any:
    """A mesh over all ranks (row-major), initialising the default group from the launcher env.

    ``timeout`` (seconds) bounds every collective of the mesh: a rank that stops taking part makes
    the others raise an error naming the collective within that time. If this call initialises the
    default process group it gets the timeout too; if the default group already exists it keeps its
    own, and the mesh's groups (also a mesh over the whole world) are new groups with ``timeout``.
    Sub-meshes (slices, flatten) inherit it.
    """
    check_optional_float("init_device_mesh", "timeout", timeout, positive=True,
                         fix="a positive number of seconds, or None for the framework's default")
    mesh_shape = _check_shape(mesh_shape)  # before the process group: a bad shape fails alike everywhere
    platform = get_platform()
    if not platform.is_initialized():
        platform.init_process_group(timeout_s=timeout)
    world = platform.get_world_size()
    known = math.prod(s for s in mesh_shape if s != -1)
    if -1 in mesh_shape:
        if world % known:
            raise ValueError(f"mesh_shape {mesh_shape}: the world size {world} is not divisible by "
                             f"{known}, so the -1 entry cannot be inferred; give sizes whose product is "
                             f"{world}")
        mesh_shape = tuple(world // known if s == -1 else s for s in mesh_shape)
    if math.prod(mesh_shape) != world:
        raise ValueError(f"mesh_shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world has "
                         f"{world}; make the product of mesh_shape equal the world size")
    return DeviceMesh(device_type, np.arange(world).reshape(mesh_shape), mesh_dim_names=mesh_dim_names,
                      _timeout=None if timeout is None else float(timeout))


def _check_shape(mesh_shape):
    """``mesh_shape`` as a tuple of positive ints, one of which may be -1 (inferred, as reshape)."""
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else mesh_shape
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"init_device_mesh: mesh_shape={mesh_shape!r} must be a tuple of positive ints, "
                         f"e.g. (2, 4)") from None
    bad = [s for s in shape
           if isinstance(s, bool) or not isinstance(s, numbers.Integral) or (s < 1 and s != -1)]
    if bad or not shape:
        raise ValueError(f"init_device_mesh: mesh_shape={mesh_shape!r} has size(s) {bad or 'none'}; every "
                         f"size must be a positive int (one may be -1, inferred from the world size)")
    if shape.count(-1) > 1:
        raise ValueError(f"init_device_mesh: mesh_shape={mesh_shape!r} has {shape.count(-1)} entries of -1; "
                         f"at most one size can be inferred from the world size")
    return tuple(int(s) for s in shape)
