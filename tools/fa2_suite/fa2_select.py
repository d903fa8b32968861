"""A pytest plugin for run.sh: narrows FlashAttention-2's ~500k cases before they run.

    --fa2-without dropout_p,local,alibi,softcap   deselect the cases that use any of these parameters (a
                                                  parameter is used when its value is truthy)
    --fa2-every N                                 keep every N-th remaining case of each test function (a
                                                  uniform sample across its parameter grid)

Deselected cases are counted by pytest as "deselected", never as passed or skipped.
"""


def pytest_addoption(parser):
    group = parser.getgroup("fa2_select")
    group.addoption("--fa2-without", default="", help="comma-separated parameter names whose truthy cases to drop")
    group.addoption("--fa2-every", type=int, default=1, help="keep every N-th case of each test function")


def pytest_collection_modifyitems(config, items):
    without = [n for n in config.getoption("--fa2-without").split(",") if n]
    every = max(1, config.getoption("--fa2-every"))
    kept, dropped, seen = [], [], {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(params.get(name) for name in without):
            dropped.append(item)
            continue
        index = seen[item.originalname] = seen.get(item.originalname, -1) + 1
        (kept if index % every == 0 else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
