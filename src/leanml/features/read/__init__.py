"""Reading raw logs: the schema and quarantine (``logschema``), the line (TSV / JSON lines) and Parquet
parsers, the chunked reader over many files (``readers``), the checks every input passes before any work
(``checks``) and the MovieLens / synthetic log writers (``data``)."""
