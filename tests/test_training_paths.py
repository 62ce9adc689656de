"""Training through every entry path equals one process of plain transformers + torch (tests/models/paths.py).

Each architecture x world size runs all seven entry paths on thread-ranks: `parallelize` on a real model, meta +
`load_sharded`, `from_pretrained`, `from_pretrained(device=)`, `apply_setup` of a search result, a
`Checkpointer` resume from a one-process save, and a converted model after `load_state_dict(assign=True)`,
`copy.deepcopy` and `torch.save` / `torch.load`. The search runs once per architecture, at 3 devices: 3 ranks apply
its best tensor-parallel candidate (its plan included), 2 ranks that candidate's setup at tp 2, which
`apply_setup` plans itself (the search's choice among setups is the estimate's, tests/estimate/test_search.py). Every rank's gradient and updated parameter are compared with the
single-process reference sliced by `shard_layouts`. Before the gradient sums moved into the modules' forward,
28 of 64 such cases were wrong (KV rows two ranks share, per-head norms, a router, on the meta paths).
"""
from __future__ import annotations

import pytest

from tests.models import paths as P


@pytest.fixture(scope="module", params=sorted(P.ARCHS))
def arch(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    base, ref = P.prepare(request.param, directory)
    return request.param, base, ref, directory, P.tp_setup(base, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_every_entry_path_trains_like_one_process(arch, world):
    name, base, ref, directory, found = arch
    setup = found if world == 3 else P.setup_at(found, world)
    tol = P.TOLERANCE.get(name, P.DEFAULT_TOL)
    bad = []
    for rank, result in enumerate(P.run(base, ref, world, directory, P.PATHS, setup=setup)):
        assert set(result) == set(P.PATHS)
        for path, worst in result.items():
            for what, (err, key) in worst.items():
                if not err <= tol:
                    bad.append(f"rank {rank} {path}: {what} {key} rel {err:.2e}")
    assert not bad, f"{name} at {world} ranks, above {tol}:\n" + "\n".join(bad[:12])
