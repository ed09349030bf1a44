"""Restricted pre-check of uploaded files, run in a separate, resource-limited subprocess."""

DETECTOR_VERSION = "precheck-1.0"
