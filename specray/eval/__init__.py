"""The reducer: feature extraction, FID via torch-fidelity, speedup tables, the report.

Entry point: ``specray.eval.reduce.reduce_run(run_dir)``. Submodules are kept
import-light; importing ``specray.eval.digits_features`` registers the
``specray-digits`` feature extractor with torch-fidelity.
"""
