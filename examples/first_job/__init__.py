"""The code of docs/tutorial-first-job.md: a signup that enqueues a welcome job."""
