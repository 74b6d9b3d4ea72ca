"""kvledger forensics: the command line today; named SQL queries over the store next."""
