"""The `treadle` command line."""
