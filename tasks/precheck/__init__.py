"""Restricted pre-check of uploaded files, run in a separate, resource-limited subprocess."""

# Raised when a detector changes what it finds: quarantine verdicts of an older version are
# looked at again (a file is re-checked, not recognised by its old verdict).
DETECTOR_VERSION = "precheck-1.1"  # 1.1: content after the container (trailing_payload)
