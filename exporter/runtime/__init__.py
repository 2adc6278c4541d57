"""Running the sources: the scheduler and the inotify watcher."""
