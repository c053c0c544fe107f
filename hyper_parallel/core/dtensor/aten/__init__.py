"""The aten-level path of DTensors on torch (below autograd): in-place ops, views, random ops and
optimizer updates (aten_dispatch.py), in-place and out= forms through their out-of-place rule
(aten_rules.py), _foreach_* and fused optimizer steps (foreach.py), writes through views that moved
data (writeback.py), in-place relabelling of dims (inplace_shape.py).

Nothing is imported here (see dispatch/__init__.py)."""
