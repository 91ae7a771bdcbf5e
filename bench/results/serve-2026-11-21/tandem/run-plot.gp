set terminal svg size 800,500
set grid
set key bottom right
set output 'bench/results/serve-2026-11-21/tandem/run-attainment.svg'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output 'bench/results/serve-2026-11-21/tandem/run-ttft.svg'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 1 using 1:3 with lines title '0.20 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 2 using 1:3 with lines title '0.40 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 3 using 1:3 with lines title '0.80 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 4 using 1:3 with lines title '1.60 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 5 using 1:3 with lines title '3.20 req/s'
set output 'bench/results/serve-2026-11-21/tandem/run-tpot.svg'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 1 using 2:3 with lines title '0.20 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 2 using 2:3 with lines title '0.40 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 3 using 2:3 with lines title '0.80 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 4 using 2:3 with lines title '1.60 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 5 using 2:3 with lines title '3.20 req/s'
set terminal pngcairo size 800,500
set grid
set key bottom right
set output 'bench/results/serve-2026-11-21/tandem/run-attainment.png'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output 'bench/results/serve-2026-11-21/tandem/run-ttft.png'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 1 using 1:3 with lines title '0.20 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 2 using 1:3 with lines title '0.40 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 3 using 1:3 with lines title '0.80 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 4 using 1:3 with lines title '1.60 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 5 using 1:3 with lines title '3.20 req/s'
set output 'bench/results/serve-2026-11-21/tandem/run-tpot.png'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 1 using 2:3 with lines title '0.20 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 2 using 2:3 with lines title '0.40 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 3 using 2:3 with lines title '0.80 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 4 using 2:3 with lines title '1.60 req/s', 'bench/results/serve-2026-11-21/tandem/run-plot.dat' index 5 using 2:3 with lines title '3.20 req/s'
