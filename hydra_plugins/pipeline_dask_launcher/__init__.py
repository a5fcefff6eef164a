"""hydra/launcher=dask: a sweep's jobs on a Dask cluster (pipeline's own launcher; see dask_launcher.py)."""
