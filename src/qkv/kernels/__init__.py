"""The paths that compute attention; `qkv.dispatch` picks one of them in one place."""
