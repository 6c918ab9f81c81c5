"""Security (seed 004): dialog security's cryptography and certificates, and permissions
granted to database roles. Below messaging (SEND seals bodies), above storage."""
