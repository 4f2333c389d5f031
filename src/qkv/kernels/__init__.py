"""The paths that compute attention; `qkv.functional` picks one of them in one place."""
