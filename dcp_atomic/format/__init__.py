"""What a checkpoint is, as data: paths and names (layout), manifests and markers, digests, the codec and the
container, the parallel layout, safe decoding.  No I/O: everything here reads and writes bytes it is given."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "blocks": ("check_block", "check_digests", "file_blocks", "verify_blocks_from", "verify_item",
               "verify_stored_file"),
    "codec": ("Decoder", "Encoder", "host_blocks", "HostBuffer", "narrow_tensor_by_index", "plane_width",
              "tensor_bytes"),
    "container": ("find_payload", "LOCAL_HEADER", "LOCAL_SIGNATURE", "PREFIX_CAPTURE"),
    "integrity": ("block_digest", "BLOCK_SIZE", "BlockHasher", "BlockSink", "HashingWriter", "sha256_hex"),
    "layout": ("ATTEMPT", "checked_checkpoint_id", "COMMITS", "data_file_name", "DATA_FILE_PATTERN",
               "DATA_PREFIX_PATTERN", "DCP_METADATA", "MANIFEST", "MARKER", "new_save_id", "no_location_error",
               "parse_checkpoint_id", "parse_step_dir", "PARTIAL_SUFFIX", "root_key", "RunLayout", "SPOOL_DIR",
               "stable_file_name", "STABLE_FILE_PATTERN", "step_dir_name", "validate_run_id", "validate_save_id",
               "validate_step"),
    "manifest": ("check_user_metadata", "CONTROL_SCHEMA", "FileEntry", "INLINE_ITEMS", "ItemExtent", "Latest",
                 "Manifest", "ManifestShard", "Marker", "now", "RankRecords", "RANKS_FILE", "sealed_json", "shard_name",
                 "ShardRef", "unseal"),
    "parallelism": ("Parallelism",),
    "safe_pickle": ("decode_item", "load_dcp_metadata", "load_refusal", "safe_byte_item"),
    "slot_record": ("DTYPE_BYTES", "SlotItem", "SlotRecord"),
})
