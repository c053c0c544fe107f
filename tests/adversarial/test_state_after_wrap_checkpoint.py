"""``torch.save(model.state_dict())`` of a fully_shard model, then ``torch.load`` in a fresh process
(SPEC §9, §19): the load needs no hyper_parallel state built beforehand (it used to fail with
``'NoneType' object has no attribute '_hp_rebuild'``) and gives the DTensors that were saved;
without a process group it raises a ValueError naming the fix."""
import socket
import subprocess
import sys
import textwrap

SAVE = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
from hyper_parallel import fully_shard, init_device_mesh
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
torch.manual_seed(0)
model = fully_shard(torch.nn.Linear(4, 3), mesh)
torch.save(model.state_dict(), sys.argv[1])
torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, sys.argv[1] + ".full")
dist.barrier()
dist.destroy_process_group()
"""

LOAD = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
import hyper_parallel.platform.torch.dtensor_base  # what get_platform() imports; core is not loaded
assert not any(name.startswith("hyper_parallel.core") for name in sys.modules)
state = torch.load(sys.argv[1])
full = torch.load(sys.argv[1] + ".full")
for name, value in state.items():
    assert type(value).__name__ == "DTensor", type(value)
    torch.testing.assert_close(value.full_tensor(), full[name])
print("LOADED", sorted(state))
dist.barrier()
dist.destroy_process_group()
try:
    torch.load(sys.argv[1])
except ValueError as exc:
    print("ERROR", exc)
"""


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(tmp_path, name, source, *args):
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_state_dict_loads_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "model.pt")
    _run(tmp_path, "save.py", SAVE, path, _port())
    out = _run(tmp_path, "load.py", LOAD, path, _port())
    assert "LOADED ['bias', 'weight']" in out, out
    assert ("ERROR loading a DTensor saved on the mesh [0] (dims ('dp',)): this process has no process group "
            "yet; start it as one of the ranks that saved it and call init_device_mesh(...)") in out, out
