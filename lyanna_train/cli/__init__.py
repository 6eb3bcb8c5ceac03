"""Console entry points. Each turns :class:`~lyanna_train.errors.LyannaError` into one line."""
