"""The converter's one error type (its own module so the plan, the styles and the steps can all raise it)."""


class PlanError(ValueError):
    """A plan that cannot be applied: unknown style, an entry that names no module, conflicting entries."""
