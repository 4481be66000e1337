"""The loop and its effects: the reducer and its pure decisions (plan, finalize, outcome),
the effects that carry them out (checkpoints, the step logger, hooks), the goodput clock."""
