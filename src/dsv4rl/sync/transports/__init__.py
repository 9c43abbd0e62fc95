"""The last stage of a weight sync, one file per way the buckets travel (`base.Transport`)."""
