"""Torch model code shared by the miles engine and trainer; filled by the [engine] issue."""
