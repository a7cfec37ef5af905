# The learner image of launch_tpu's XPK mode (--xpk_cluster): this checkout, JAX for TPU, and gcloud, with which
# a pod derives its learner credential from Secret Manager and fetches the run's CA from the bucket.
#   docker build --build-arg=EXTRAS=tfds -t gcr.io/PROJECT/decoupled-diloco:RUN . && docker push ...
# (launch_tpu start --xpk_cluster=... runs both.)
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl gnupg \
    && curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg \
       | gpg --dearmor -o /usr/share/keyrings/cloud.google.gpg \
    && echo "deb [signed-by=/usr/share/keyrings/cloud.google.gpg] https://packages.cloud.google.com/apt cloud-sdk main" \
       > /etc/apt/sources.list.d/google-cloud-sdk.list \
    && apt-get update && apt-get install -y --no-install-recommends google-cloud-cli \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY setup.py ./
COPY decoupled_diloco decoupled_diloco
COPY experiments experiments
COPY configs configs
# Extras of setup.py: 'tfds' for TFDS / ArrayRecord data (launch_tpu passes what the config reads).
ARG EXTRAS=""
RUN pip install --no-cache-dir -e ".${EXTRAS:+[$EXTRAS]}" "jax[tpu]"
