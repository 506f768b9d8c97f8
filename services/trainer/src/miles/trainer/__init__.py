"""miles trainer: the model being trained, its optimizer and checkpoints; losses, advantages and off-policy
correction; exactly-once consumption of buffer groups.
"""
