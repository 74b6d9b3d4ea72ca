"""kvledger's live exposure dashboard (Streamlit): ``kvledger dashboard`` runs ``dashboard/app.py``."""
