"""The bundled client library of pagestream: enqueue requests on Redis and read their tokens.

It depends on the wire types only and never imports torch; the Redis client lands with the
worker service.
"""
