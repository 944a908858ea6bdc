"""checkpoints: the system of record for weight versions (manifests, shards, announcements, retention)."""
