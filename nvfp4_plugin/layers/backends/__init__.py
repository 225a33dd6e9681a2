"""Layer backends, one file each, registered in priority order (fastest first, reference last)."""
