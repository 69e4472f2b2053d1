"""The thin public layer: one module per operator that validates, picks the layout and dtype
view, allocates the result and calls the kernel."""
