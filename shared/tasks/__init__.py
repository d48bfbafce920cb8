"""One module per task: the model, the data, the loss and the metrics a user changes first.

shared/core/tasks.py loads the one --task names; a copy carries its recipe's default task
(`python -m shared.tools.cp RECIPE DEST --task NAME` adds others)."""
