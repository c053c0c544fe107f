"""One check that the ranks agree on the settings of a feature (SPEC §19 "Ranks that disagree").

A feature (ContextParallel, linear attention, the chunked loss, fully_shard, ...) names what
must be the same on every rank of its mesh: ``settings``, a mapping name -> value (ints, floats
including NaN/inf, bools, strings, None, tuples, tensors by their metadata, or a ``Deferred``
content digest). Each rank encodes them into a vector of FIXED length whatever the settings:

    [crc32(feature), crc32(sorted names), count, crc32(value of name 0), ..., crc32(rest)]

(names sorted; more than ``MAX_FIELDS`` settings fold the rest into the last field). The vector
and its negation are min-reduced over the mesh (one small all-reduce per mesh dim, on the platform's
``agreement_group`` companion of each mesh group), so every rank learns which fields differ and
all ranks raise the same ValueError, naming the feature, the setting(s) that differ, this rank's
value and the fix. A fixed length matters: a message whose size depended on the settings would
itself abort gloo.

When the exchange runs (the schedule). Every rank decides locally, without communicating, and a
rank that enters the exchange while a peer does not would wait for it. The decision key is
``(feature, mesh, signature, the encoded eager settings)`` and the call site is ``(feature, mesh,
signature)``: the check runs at the first call of a site, and whenever a site's key is not the one
that followed its previous call's key the last time (a new shape, another ``is_causal``, back to a
key verified long ago); never for a call that continues its site's sequence as before (the same
key again, or a site alternating between causal and non-causal layers). In a correct program
every rank computes the same sequence of keys at each site, so every rank takes the same decision:
all enter the exchange together, or none does; a repeated call adds no collective and no host sync.
Ranks that disagree from a call on all have a changed key there, so they all check and all raise.
``Deferred`` values (a content digest of a mask, of labels) are left out of the key: they change
every step, so they are computed and compared only when a check runs anyway (``every_only=True``:
only under ``HP_CHECK_RANKS=every``).

A rank whose settings change ALONE (its peers continue as before) is the one rank whose site
sees a change, so it enters the exchange alone. The exchange runs on the platform's
``agreement_group``, a companion created beside each group of a mesh built with ``timeout=``
(torch): the lone rank waits
there, never inside its peers' data collectives (which would abort gloo on a size mismatch, or
combine unrelated buffers), until the mesh's ``timeout=`` (``init_device_mesh(..., timeout=)``)
expires; it then raises a ValueError naming the feature and the settings it changed, and its peers'
next collective times out the same way (a CollectiveTimeoutError naming the group). Without a
companion (MindSpore; a torch mesh without ``timeout=``) the exchange runs on the mesh group itself,
where a lone rank meets its peers' next collective. ``HP_CHECK_RANKS=every``
(set alike on every rank) exchanges on every call, so the first differing call raises a
ValueError on every rank, including for ``Deferred`` digests.

Caches live in ``BoundedCache`` (emptied at ``reset_platform``); callers build signatures from
``lifetime_key`` (never ``id()``), so a verified decision never outlives its object.
"""
import math
import zlib
from collections.abc import Hashable, Mapping
from typing import Any, Callable, Optional

import numpy as np

from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.dtensor.rank_check import CHECK_RANKS_ENV as CHECK_ENV
from hyper_parallel.core.dtensor.rank_check import check_every, dtype_name
from hyper_parallel.platform import get_platform

MAX_FIELDS = 24
_MASK = (1 << 31) - 1


class Deferred:
    """A setting computed only when the exchange runs (``fn()`` -> any encodable value), left out
    of the schedule's key: for content digests that change every step (mask documents, labels).
    ``every_only``: computed and compared only under ``HP_CHECK_RANKS=every``."""

    __slots__ = ("fn", "every_only")

    def __init__(self, fn: Callable[[], object], every_only: bool = False) -> None:
        self.fn, self.every_only = fn, bool(every_only)


# ---------------------------------------------------------------------- encoding
def _is_tensor(value: object) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


def _canonical(value: Any) -> str:
    """A text equal on two ranks exactly when the values are the same setting: 2 == 2.0 (numbers
    by value), True is not 1, NaN equals NaN, a tensor is its dtype and shape."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return f"b:{value}"
    if isinstance(value, (int, np.integer)):
        whole = int(value)
        return f"n:{float(whole)!r}" if abs(whole) < (1 << 53) else f"i:{whole}"
    if isinstance(value, (float, np.floating)):
        real = float(value)
        return "n:nan" if math.isnan(real) else f"n:{real!r}"
    if isinstance(value, str):
        return f"s:{value}"
    if isinstance(value, (tuple, list)):
        return "t:(" + ",".join(_canonical(v) for v in value) + ")"
    if isinstance(value, Mapping):
        return "m:{" + ",".join(f"{k}={_canonical(value[k])}" for k in sorted(value, key=str)) + "}"
    if _is_tensor(value):
        return f"T:{dtype_name(value.dtype)}{tuple(int(s) for s in value.shape)}"
    return f"r:{type(value).__name__}:{value!r}"


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & _MASK


def _field(value: Any) -> tuple:
    """(crc, shown text) of one setting; never raises (a rank that raised here would leave its
    peers in the exchange)."""
    try:
        if isinstance(value, Deferred):
            value = value.fn()
        text = _canonical(value)
        shown = (f"{dtype_name(value.dtype)} tensor of shape {tuple(int(s) for s in value.shape)}"
                 if _is_tensor(value) else repr(value))
    except Exception as exc:  # noqa: BLE001 - reported through the exchange instead
        text = shown = f"<cannot read: {type(exc).__name__}: {exc}>"
    return _crc(text), shown


def _host_array(tensor: Any) -> np.ndarray:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(local, "asnumpy"):           # MindSpore
        try:
            return local.asnumpy()
        except TypeError:                   # bfloat16: numpy has none
            return local.astype(np.float32).asnumpy()
    # a copy: numpy() on the tensor itself would pin its storage (no longer resizable), and
    # fully_shard frees a gathered parameter by resizing its storage to 0
    local = local.detach().cpu().clone()
    try:
        return local.numpy()
    except TypeError:
        return local.float().numpy()


def tensor_digest(tensor: Any) -> Optional[str]:
    """A text equal on ranks holding equal tensors (dtype, shape and bytes; NaNs made canonical);
    None for None. Reads the tensor to the host: only use inside ``Deferred``."""
    if tensor is None:
        return None
    array = np.ascontiguousarray(_host_array(tensor))
    if array.dtype.kind in "fc":
        array = np.where(np.isnan(array), np.nan, array)
    body = zlib.crc32(array.tobytes())
    return f"{dtype_name(tensor.dtype)}{tuple(int(s) for s in tensor.shape)}#{body:08x}"


def _encode(feature: str, settings: Mapping, every: bool) -> tuple:
    """(vector, names, shown texts) of this rank's settings."""
    names = sorted(str(n) for n in settings)
    by_name = {str(n): v for n, v in settings.items()}
    crcs, shown = [], []
    for name in names:
        value = by_name[name]
        if isinstance(value, Deferred) and value.every_only and not every:
            crc, text = 0, "<compared under HP_CHECK_RANKS=every>"
        else:
            crc, text = _field(value)
        crcs.append(crc)
        shown.append(text)
    head = crcs[:MAX_FIELDS - 1] + [0] * max(0, MAX_FIELDS - 1 - len(crcs))
    rest = _crc(repr(crcs[MAX_FIELDS - 1:])) if len(crcs) >= MAX_FIELDS else 0
    vector = [_crc(feature), _crc(repr(names)), len(names)] + head + [rest]
    return vector, names, shown


def _key_fields(settings: Mapping) -> tuple:
    """The eager settings' encoding: the part of the schedule's key that settings contribute."""
    return tuple((str(n), _field(v)[0]) for n, v in sorted(settings.items(), key=lambda kv: str(kv[0]))
                 if not isinstance(v, Deferred))


# ---------------------------------------------------------------------- the exchange
# a call site -> the key fields of its previous call; (site, previous fields) -> the fields that
# followed them the last time a check passed (so a site alternating between two keys, say causal
# and non-causal layers sharing a style, does not check at every call)
_LAST = BoundedCache(4096)
_NEXT = BoundedCache(4096)
_RAISED = object()   # the previous call raised (or never finished its check): check the next one


def _group_key(mesh_or_group: Any) -> Hashable:
    if hasattr(mesh_or_group, "get_group"):
        return ("mesh", mesh_or_group)
    return ("group", mesh_or_group)


def _peers(mesh_or_group: Any) -> int:
    if hasattr(mesh_or_group, "get_group"):
        return 0 if mesh_or_group.get_coordinate() is None else mesh_or_group.size()
    return get_platform().get_world_size(mesh_or_group)


def _groups(mesh_or_group: Any) -> list:
    """The groups the exchange runs on: one per mesh dim (their agreement companions)."""
    platform = get_platform()
    if hasattr(mesh_or_group, "get_group"):
        return [platform.agreement_group(mesh_or_group.get_group(m)) for m in range(mesh_or_group.ndim)]
    return [platform.agreement_group(mesh_or_group)]


def _min_max(mesh_or_group: Any, vector: list) -> tuple:
    platform = get_platform()
    device = getattr(mesh_or_group, "device_type", None)
    device = None if device in (None, "cpu", "meta") else device
    both = platform.tensor([int(v) for v in vector] + [-int(v) for v in vector], device=device)
    for group in _groups(mesh_or_group):
        both = platform.all_reduce(both, group, "min", tag="shape_check")
    if platform.is_fake(both):   # a dry run (hyper_parallel.plan): one rank on fake tensors, agreed
        return [int(v) for v in vector], [int(v) for v in vector]
    both = [int(v) for v in both.tolist()]
    n = len(vector)
    return both[:n], [-v for v in both[n:]]


def check_agreement(mesh_or_group: Any, feature: str, settings: Mapping[str, object], *,
                    signature: Optional[Hashable] = None, fix: Optional[str] = None,
                    once: bool = True) -> None:
    """ValueError on every rank of ``mesh_or_group`` (a DeviceMesh or a process group) unless
    every rank passes the same ``settings`` for ``feature``. Exchanges one small fixed-length
    message at the first call of each (feature, mesh, signature) site, whenever the site's key
    departs from the sequence it followed before, and on every call under
    ``HP_CHECK_RANKS=every`` (schedule and its limits: module docstring). ``signature``: what else
    distinguishes the call site (e.g. ``lifetime_key(style)``, shapes); ``fix``: the sentence
    telling the user what to do, appended to the error. ``once=False``: on every call (setup-time
    checks, run once per wrapped module: a key verified for another module must not let ranks
    that now disagree pass)."""
    if _peers(mesh_or_group) <= 1:
        return
    every = check_every()
    site = (feature, _group_key(mesh_or_group), signature)
    fields = _key_fields(settings)
    previous = _LAST.get(site)
    if once and not every and previous is not _RAISED and _NEXT.get((site, previous)) == fields:
        _LAST[site] = fields
        return   # the hot path: this site follows its previous key with the key it followed it with before
    vector, names, shown = _encode(feature, settings, every)
    _LAST[site] = _RAISED   # until every rank passes: a call that raised makes the next call check
    try:
        mins, maxs = _min_max(mesh_or_group, vector)
    except (RuntimeError, TimeoutError) as exc:   # the peers never came: this rank changed alone
        raise AgreementTimeoutError(_alone(mesh_or_group, feature, previous, fields, shown, names, fix,
                                           exc)) from exc
    if mins != maxs:
        raise ValueError(_message(mesh_or_group, feature, names, shown, mins, maxs, fix))
    if previous is not _RAISED:
        _NEXT[(site, previous)] = fields
    if (site, fields) not in _NEXT:   # until seen otherwise, a key is expected to repeat
        _NEXT[(site, fields)] = fields
    _LAST[site] = fields


class AgreementTimeoutError(ValueError, TimeoutError):
    """An agreement check the other ranks never joined within the mesh's timeout. Both a ValueError
    (the likely cause a rank can act on: it changed a setting alone, so it checked while its peers
    did not) and a TimeoutError (the peers may instead have skipped the step, raised or died)."""


def _alone(mesh_or_group: Any, feature: str, previous: Optional[tuple], fields: tuple, shown: list,
           names: list, fix: Optional[str], exc: BaseException) -> str:
    """The error of a rank whose exchange its peers never joined."""
    before = dict(previous) if isinstance(previous, tuple) else {}
    changed = [f"{n} (rank {get_platform().get_rank()} now has {_show(shown[names.index(n)])})"
               for n, crc in fields if n in before and before[n] != crc and n in names]
    now = _show(", ".join(f"{n}={t}" for n, t in zip(names, shown)), 400)
    what = (f"this rank's {', '.join(changed)} changed since its previous call here (its settings now: "
            f"{now}), so it checked again" if changed else f"this rank reached a check (its settings: {now})")
    return (f"{feature}: the agreement check on {_where(mesh_or_group)} was not joined by the other ranks "
            f"within the timeout: {what}; either they skipped this step (raised, exited) or they "
            f"continued with their previous settings. Every rank "
            f"must pass the same settings, and change them together ({CHECK_ENV}=every checks every call). "
            f"Fix: {fix or 'pass the same value on every rank'}. ({type(exc).__name__}: "
            f"{_show(str(exc).splitlines()[0] if str(exc) else '')})")


def _where(mesh_or_group: Any) -> str:
    return str(mesh_or_group) if hasattr(mesh_or_group, "get_group") else \
        f"process group {tuple(get_platform().group_ranks(mesh_or_group))}"


def _message(mesh_or_group: Any, feature: str, names: list, shown: list, mins: list, maxs: list,
             fix: Optional[str]) -> str:
    rank = get_platform().get_rank()
    where = _where(mesh_or_group)
    fix = fix or "pass the same value on every rank"
    if mins[0] != maxs[0]:
        return (f"{feature}: the ranks of {where} reached different checks (rank {rank} checks {feature}): "
                f"they call the library's features in a different order or a different number of times; "
                f"make every rank run the same code path")
    if mins[1:3] != maxs[1:3]:
        return (f"{feature}: the ranks of {where} pass different sets of settings (rank {rank} has "
                f"{names}); make every rank take the same code path (same arguments, same options)")
    differ = [i for i in range(len(names)) if i < MAX_FIELDS - 1 and mins[3 + i] != maxs[3 + i]]
    parts = [f"{names[i]} (rank {rank} has {_show(shown[i])})" for i in differ]
    if mins[-1] != maxs[-1]:
        parts.append(f"one of {names[MAX_FIELDS - 1:]}")
    return (f"{feature}: the ranks of {where} disagree on {', '.join(parts)}; every rank must pass the same "
            f"settings ({CHECK_ENV}=every checks every call). Fix: {fix}")


def _show(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
