"""The pagestream service: the ``pagestream`` CLI, and the Redis worker around the engine."""
