//! The consumer groups' HTTP API against the real database, over real HTTP.

mod http;
