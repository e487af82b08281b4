"""The sections of the bench, one module (or package) each, as bench/__main__.py's SECTIONS
lists them: `run(lab)` returns the section's figures."""
