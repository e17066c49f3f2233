-- Statements the throwaway cluster (pgcluster.rs) runs.

-- name: data_directory
-- The server's data directory: tells our server from another one that
-- answers on the same port.
SHOW data_directory;
