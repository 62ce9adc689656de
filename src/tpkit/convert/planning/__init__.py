"""Step 2 of conversion, the plan: the registered families' proposals made into a `Plan` for a world size
(`planner`), the plan of repeated blocks taken from their distinct ones (`reuse`), and the dry run that runs the
planned structure once on meta tensors before anything changes (`dryrun`, with the head-reshape check it makes,
`head_reshapes`)."""
