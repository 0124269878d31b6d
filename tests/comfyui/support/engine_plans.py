"""LoadPlans that attach a set residency, for tests that drive the engine directly."""


def load_plan(residency, *, ram_blocks=None, compress=False, may_code=False, pin_memory="auto"):
    """A swap.load_plan.LoadPlan that attaches `residency` as given (what a test of the engine
    needs of a plan: no window planning), with these RAM homes, coding and pinning."""
    from ringswap.swap.coding_choice import CodingChoice
    from ringswap.swap.load_plan import LoadPlan, SwapSettings
    from ringswap.swap.ram_split import RamSplit
    from ringswap.swap.window_plan import PlanInputs, WindowPlan
    n = residency.num_blocks
    window = WindowPlan(PlanInputs(block_sizes=(0,) * n, nonblock_bytes=0, free_bytes=0), residency, False)
    ram = None if ram_blocks is None else RamSplit(residency, (0,) * n, frozenset(ram_blocks), 0, "test")
    return LoadPlan(window, ram, CodingChoice(compress, "", may_code), SwapSettings(0, pin_memory=pin_memory))


def blocks_on_device(engine) -> list[int]:
    """Blocks whose weights occupy device memory now: resident ones and ring owners."""
    from ringswap.swap.facts import live_view
    view = live_view(engine)
    return [] if view is None else [i for i, c in enumerate(view.places) if c in "GRC"]
