set terminal svg size 800,500
set grid
set key bottom right
set output '/root/out/disagg/bench-llama2-7b-attainment.svg'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output '/root/out/disagg/bench-llama2-7b-ttft.svg'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 1 using 1:3 with lines title '2.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 2 using 1:3 with lines title '4.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 3 using 1:3 with lines title '8.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 4 using 1:3 with lines title '16.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 5 using 1:3 with lines title '32.00 req/s'
set output '/root/out/disagg/bench-llama2-7b-tpot.svg'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 1 using 2:3 with lines title '2.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 2 using 2:3 with lines title '4.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 3 using 2:3 with lines title '8.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 4 using 2:3 with lines title '16.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 5 using 2:3 with lines title '32.00 req/s'
set terminal pngcairo size 800,500
set grid
set key bottom right
set output '/root/out/disagg/bench-llama2-7b-attainment.png'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output '/root/out/disagg/bench-llama2-7b-ttft.png'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 1 using 1:3 with lines title '2.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 2 using 1:3 with lines title '4.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 3 using 1:3 with lines title '8.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 4 using 1:3 with lines title '16.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 5 using 1:3 with lines title '32.00 req/s'
set output '/root/out/disagg/bench-llama2-7b-tpot.png'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot '/root/out/disagg/bench-llama2-7b-plot.dat' index 1 using 2:3 with lines title '2.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 2 using 2:3 with lines title '4.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 3 using 2:3 with lines title '8.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 4 using 2:3 with lines title '16.00 req/s', '/root/out/disagg/bench-llama2-7b-plot.dat' index 5 using 2:3 with lines title '32.00 req/s'
