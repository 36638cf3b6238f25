"""The commit protocol over a store: attempts, markers, ``LATEST``, the commit journal, retention, catalogues of
steps, locations and lineages.  What "committed" means is decided here and only here."""
