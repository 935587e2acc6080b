from fewbits.cli import main

main(prog_name="fewbits")
