"""Where finished exports are kept. ``file://`` here; other backends plug in beside it."""
