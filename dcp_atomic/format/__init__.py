"""What a checkpoint is, as data: paths and names (layout), manifests and markers, digests, the codec and the
container, the parallel layout, safe decoding.  No I/O: everything here reads and writes bytes it is given."""
