# The MLflow tracking server with the PostgreSQL driver (3.5 or later: it has --allowed-hosts).
FROM python:3.11-slim
RUN pip install --no-cache-dir "mlflow>=3.5,<4" psycopg2-binary
EXPOSE 5000
