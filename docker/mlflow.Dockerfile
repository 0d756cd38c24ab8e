# The MLflow tracking server with the PostgreSQL driver, MLflow at the version constraints.txt pins.
# Its entrypoint builds the store's URL from REPSIM_DB_USER and REPSIM_DB_PASSWORD, URL-encoded, and
# hands it to `mlflow server` in the environment, so the password is never on a command line.
FROM python:3.11-slim
COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir -c /tmp/constraints.txt mlflow psycopg2-binary \
 && rm /tmp/constraints.txt \
 && useradd --uid 1000 mlflow \
 && mkdir -p /mlartifacts \
 && chown mlflow /mlartifacts
COPY docker/mlflow_server.py /usr/local/bin/mlflow-server
USER mlflow
EXPOSE 5000
ENTRYPOINT ["python", "/usr/local/bin/mlflow-server"]
