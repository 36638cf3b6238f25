"""The commit protocol over a store: attempts, markers, ``LATEST``, the commit journal, retention, catalogues of
steps, locations and lineages.  What "committed" means is decided here and only here."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    # catalog's resume_point takes a root (the public one); commit's, which takes a layout, shares its name
    "catalog": ("DEFAULT_TIMEOUT", "latest_step", "list_steps", "most_recent", "resolve", "resume_point",
                "shows_at_once"),
    "commit": ("commit", "claim_attempt", "commit_order", "commit_step", "CommitPolicy", "Committed", "copy_control",
               "Evidence", "known_sequence", "listed_steps", "memory_order",
               "next_sequence", "note_sequence", "publish_control", "root_sequence",
               "read_claim", "read_committed", "read_marker", "read_marker_once",
               "record_local_marker", "refuse_committed", "require_complete", "ResumePoint", "scan_markers"),
    "lineage": ("create_lineage", "describe", "ensure_lineage", "lineage_path", "new_lineage", "read_lineage",
                "refuses_writes"),
    "links": ("Base", "base_files", "choose_base", "holds_referenced", "link_verified", "load_base",
              "referenced_bytes", "referencing"),
    "location": ("is_checkpoint_id", "open_location", "retarget"),
    "retention": ("apply_gc", "DEFAULT_LEASE_SECONDS", "plan_gc", "remove_run", "remove_step", "retain_after_commit"),
    "retention_policy": ("Best", "metric_reader", "retained", "Retention"),
})
