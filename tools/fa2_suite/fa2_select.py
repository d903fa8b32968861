"""A pytest plugin for run.sh: narrows FlashAttention-2's ~500k cases before they run.

    --fa2-without dropout_p,local,alibi,softcap   deselect the cases that use any of these parameters (a
                                                  parameter is used when its value is truthy)
    --fa2-every N                                 keep every N-th remaining case of each test function (a
                                                  uniform sample across its parameter grid)
    --fa2-part K/N                                part K (0 .. N-1) of N disjoint parts of what remains: the
                                                  parts together are every case, for runs split over machines

Deselected cases are counted by pytest as "deselected", never as passed or skipped.
"""


def pytest_addoption(parser):
    group = parser.getgroup("fa2_select")
    group.addoption("--fa2-without", default="", help="comma-separated parameter names whose truthy cases to drop")
    group.addoption("--fa2-every", type=int, default=1, help="keep every N-th case of each test function")
    group.addoption("--fa2-part", default="0/1", help="K/N: keep part K of N disjoint parts of the remaining cases")


def pytest_collection_modifyitems(config, items):
    without = [n for n in config.getoption("--fa2-without").split(",") if n]
    every = max(1, config.getoption("--fa2-every"))
    part, parts = (int(n) for n in config.getoption("--fa2-part").split("/"))
    kept, dropped, seen = [], [], {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(params.get(name) for name in without):
            dropped.append(item)
            continue
        index = seen[item.originalname] = seen.get(item.originalname, -1) + 1
        (kept if index % every == 0 and index // every % parts == part else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
