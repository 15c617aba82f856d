-- One Postgres, two databases: Prefect's and MLflow's (each server migrates its own schema).
CREATE DATABASE prefect OWNER lifecycle;
CREATE DATABASE mlflow OWNER lifecycle;
