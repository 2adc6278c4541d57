"""Running the sources: the scheduler, the inotify watcher, state that outlives one run."""
