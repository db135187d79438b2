"""DTensor inputs (docs/design.md, "DTensor"): no op registers a sharding strategy, so a DTensor
argument to a kernel raises PyTorch's error naming the op, in eager and compiled code, before any compute;
`torch.distributed.tensor.experimental.local_map` runs an op on each rank's shard.

One process, a gloo group of one rank: enough to reach DTensor's dispatch, which is where the
error, local_map's unwrapping and FSDP2's parameter handling happen."""

import pytest
import torch
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.experimental import local_map  # noqa: E402

from tokamax_torch.ops import layer_norm as ln  # noqa: E402
from tokamax_torch.ops import linear_softmax_cross_entropy_loss as lce  # noqa: E402
from test_op_contract import CONTRACTS  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("contract", [pytest.param(c, id=c.name) for c in CONTRACTS])
def test_dtensor_inputs_raise_naming_the_op(mesh, contract):
    args, kwargs = contract.samples[0].make()
    replicated = lambda x: distribute_tensor(x.detach(), mesh, [Replicate()]) if isinstance(x, torch.Tensor) else x  # noqa: E731
    args = tuple(replicated(x) for x in args)
    kwargs = {key: replicated(x) for key, x in kwargs.items()}
    name = contract.kernel.op.name().replace("::", ".")
    before = [x.to_local().clone() for x in (*args, *kwargs.values()) if isinstance(x, DTensor)]
    with pytest.raises(NotImplementedError, match=rf"Operator {name}\.default does not have a sharding strategy"):
        contract.kernel(*args, **kwargs)
    after = [x.to_local() for x in (*args, *kwargs.values()) if isinstance(x, DTensor)]
    bits = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731 (NaN inputs compare by their bits)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(after, before)), "an input was written"


def test_dtensor_under_compile_raises_naming_the_op(mesh):
    x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
    with pytest.raises(Exception, match=r"Operator tokamax\.layer_norm\.default does not have a sharding strategy"):
        torch.compile(ln.kernel, fullgraph=True)(x)


def test_local_map_runs_the_op_on_each_shard(mesh):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    norm = local_map(ln.kernel, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    got = norm(sharded)
    assert isinstance(got, DTensor) and got.placements == (Shard(0),)
    assert torch.equal(got.full_tensor(), ln.kernel(x))


class _LossHead(torch.nn.Module):
    """A projection and an lm_head whose weight the fused loss reads in the module's forward."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)

    def forward(self, x, labels):
        return lce.kernel(self.proj(x), labels, self.lm_head.weight.t())


def test_fsdp2_sharded_lm_head_gives_the_unsharded_loss_and_gradients(mesh):
    """user-needs.md: the fused loss with an FSDP2-sharded lm_head. FSDP2 unshards a unit's
    parameters into plain tensors for its forward, so the op sees no DTensor; the gradients come
    back as DTensors and equal the unsharded module's."""
    torch.manual_seed(0)
    sharded, plain = _LossHead(), _LossHead()
    plain.load_state_dict(sharded.state_dict())
    fully_shard(sharded, mesh=mesh)
    x, labels = torch.randn(8, 16), torch.randint(0, 50, (8,))
    loss, want = sharded(x, labels), plain(x, labels)
    loss.backward()
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        assert isinstance(p.grad, DTensor) and torch.equal(p.grad.full_tensor(), q.grad), name
