"""The fault proof: a soak of real jobrelay processes under kill -9 and service restarts.

``jobrelay chaos`` (``make chaos``) submits exports over HTTP while a seeded controller kills
processes, crashes them at every named fault point and restarts RabbitMQ and PostgreSQL, then
checks from the database, the broker, the bucket and the mail sink that nothing accepted was
lost and nothing was done twice. Modelled on the lost / duplicated / recovered checker of
RabbitMQ's Jepsen tests. It needs the ``chaos`` extra (moto, aiosmtpd) for its S3 and SMTP
servers.
"""
