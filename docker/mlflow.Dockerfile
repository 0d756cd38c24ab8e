# The MLflow tracking server with the PostgreSQL driver.
FROM python:3.11-slim
RUN pip install --no-cache-dir "mlflow>=3,<4" psycopg2-binary
EXPOSE 5000
