"""The launch-floor stand-ins compiled on the GPU: the chain kernel stores what its twin says, with PDL and without,
inside a CUDA graph of chained launches (bench.launch_floor times exactly such graphs)."""

from __future__ import annotations

import pytest
import torch

from loraplex.bench import launch_floor
from loraplex.kernels.lora_shrink import pdl_supported

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("pdl", [False, True])
def test_chain_stand_ins_in_a_graph_store_their_twin(pdl):
    device = torch.device("cuda")
    if pdl and not pdl_supported(device):
        pytest.skip("PDL needs sm_90+")
    from loraplex.bench.lora_kernels import _capture

    launches = [{"kind": "shrink", "grid": (40, 1, 3), "num_warps": 2, "pdl": pdl},
                {"kind": "expand", "grid": (64, 2, 1), "num_warps": 4, "pdl": pdl}] * 3
    stand = launch_floor._Stand(launches, device, torch.bfloat16)
    for body in ("empty", "chain"):
        stand.out.fill_(-7.0)
        graph = _capture(lambda body=body: stand.run(body, "as recorded"), device)
        graph.replay()
        torch.cuda.synchronize()
        if body == "empty":
            assert torch.all(stand.out == -7.0)
    # the last launch wrote its 128 programs' rows last; the widest grid is 128 programs
    want = launch_floor.chain_reference(stand.table, stand.w, stand.x, 5 * stand.widest, 128)
    torch.testing.assert_close(stand.out[:128], want, rtol=1e-3, atol=1e-3)
